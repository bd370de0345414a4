"""No processes: declarations to stage graphs (partition, traced split, chain proof, balance), materialization, placement, schedule, lengths."""
