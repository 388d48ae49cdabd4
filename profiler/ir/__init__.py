"""The IR: an ONNX file loaded and imported into Relax, every node tagged with its profileID,
our Relax passes, and the lineage of every ID through every stage."""
