"""The run's schema and how a user's file becomes it: the bottom layer, read by everything above
(specs, plan, run, train, the CLI). Torch-free."""
