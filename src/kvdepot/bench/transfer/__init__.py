"""`kvdepot bench transfer`: stores and retrieves against the server beside the copy limit
measured in the same run. `command.py` declares and runs it; the engine processes it
starts, the limits, the load and the report are the other modules."""
