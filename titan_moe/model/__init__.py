"""The K3-class decoder: args, layers and the model."""
