"""Speaking Redis: connecting, the embedded server and its AOF, one `Stream` with its consumer group,
stream-id arithmetic, and auto-pipelining of script calls.
"""
