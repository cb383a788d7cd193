"""torch.optim optimizers as optax transformations with torch's own arithmetic: the update rules, reading param
groups, and the transformation a Trainer steps with. Part of _train: may import what _train may."""
