"""The algorithm service: drives a training run (`fulmen algorithm`)."""
