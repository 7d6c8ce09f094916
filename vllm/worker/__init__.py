"""The model runner: one engine step's inputs, the forward pass and the logits."""
