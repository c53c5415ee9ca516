"""The boundary to the server: the engine's own process, the pipe, and what crosses it (output
deltas, commands).
"""
