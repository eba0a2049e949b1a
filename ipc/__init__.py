"""The wire between Relay's processes: typed messages, one msgpack codec, ZeroMQ sockets.

ipc sits above src/relay and imports it, never the reverse: the step contract (BatchInput,
BatchOutput, SamplingSpec in relay.step), RequestOutput (relay.outputs) and
DetokenizeSpec (relay.text.detokenizer) are also what the offline Engine passes in-process, and
they carry relay's SamplingParams, so they stay in relay. ipc.codec.WIRE_TYPES lists every type
that crosses a process boundary; ipc.messages holds those only processes send."""
