"""Dynamic batching: admitted requests split into sequences, packed into forwards, reassembled."""
