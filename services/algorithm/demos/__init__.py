"""The demos' preparation: the arithmetic demo (`fulmen demo`) and the tool-use demo (`--task tools`)."""
