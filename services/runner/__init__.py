"""The runner service: claims rollouts and runs the user's agent on them (`fulmen runner`)."""
