"""shardwise: plan, train and measure multi-GPU SFT across DeepSpeed ZeRO, FSDP2 and DDP."""

__version__ = "0.1.0"
