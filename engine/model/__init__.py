"""The model's networks, one module per component, with the official parameter names."""
