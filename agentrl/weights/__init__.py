"""A trainer's weights on disk, as both the trainer backends and the samplers read them:
the checkpoint folder's layout and how it is committed (`checkpoint.py`), and LoRA
adapters, added for training and merged for sampling (`lora.py`, `config.py`)."""
