"""What the trainer drives: engines (pipeline, DDP), the training loop, prediction, the Chrome timeline."""
