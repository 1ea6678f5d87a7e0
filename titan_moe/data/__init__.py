"""Real-text data: corpus reading, document packing and the torchtitan dataloader."""
