"""The MoE decoder LM, the omni model and the video DiT: plain nn.Modules."""
