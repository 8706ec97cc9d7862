"""The SFT trainer: one loop over DeepSpeed ZeRO 0-3, FSDP2 and DDP engines.

Importing this package is cheap; torch, deepspeed and transformers load only in the modules
that need them (config validation runs before any rank starts and must stay light).
"""
