"""Fused ops: a torch reference per op plus Triton / flash-attn versions, one registry."""
