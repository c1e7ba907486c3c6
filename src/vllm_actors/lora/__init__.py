"""LoRA adapters: PEFT adapters read and checked (``adapter``), their device slots (``slots``) and the
worker's manager (``manager``).
"""
