"""verify_lora: proof that the adapter is trained, from what PEFT built on the base model, its
config against params.yaml and its effect on the logits of a fixed input (`lora`)."""
