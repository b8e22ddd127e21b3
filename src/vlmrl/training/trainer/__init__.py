"""TRL's GRPOTrainer and SFTTrainer subclassed (`trainers`), with every behaviour the project
changes in a module of its own that the subclasses hook in through overridden methods, and the
configs both are built from (`config`). Shared by the SFT and GSPO stages."""
