"""Vision (image, video) and audio encoders and their projectors: plain nn.Modules."""
