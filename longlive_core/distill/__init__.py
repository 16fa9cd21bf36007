"""DMD distillation of the AR model into a few-step generator (LoRA adapters over a frozen backbone)."""
