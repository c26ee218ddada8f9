"""ddpscale: configuration-driven scaling experiments for data-parallel PyTorch training."""

__version__ = "0.1.0"
