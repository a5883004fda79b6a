"""Model versions: what one holds (`manifest`), its bytes (`blobs`, `delta`, `lora`, `folder`), how it
travels (`transport/`), which are kept (`retention`); `model_version` publishes and fetches them.
"""
