"""The wire between Relay's processes: typed messages, one msgpack codec, ZeroMQ sockets."""
