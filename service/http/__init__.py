"""The HTTP edge: FastAPI app, request/response schemas, body encodings, errors, metrics, validation."""
