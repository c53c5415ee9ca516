"""A checkpoint into the model: the loader, checkpoint formats (GPTQ, AWQ, MXFP4, ...), int8 /
int4 quantization with its calibration and rotation.
"""
