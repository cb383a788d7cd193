"""Other formats in and out: safetensors, Hugging Face pretrained checkpoints, peft adapters, torch state_dicts, DCP.

May import _ckpt and everything below it.
"""
