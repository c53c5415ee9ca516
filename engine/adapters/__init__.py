"""LoRA adapters: reading and checking them, the device slots, and the tiers they are loaded
through.
"""
