"""What a model is: layout specs, layers, MoE experts, CPU packing, the decoder, the tokenizer,
the demo model.
"""
