"""The `shardwise` command: its verbs (app.py), plan's and explain's input handling
(plan_inputs.py) and what they print (render*.py)."""
