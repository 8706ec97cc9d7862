"""The model a rank trains: built from the run (catalog config or checkpoint), its weights read
into each rank's part, adapters, tensor parallelism, packed attention, compiled layers and the
loss head."""
