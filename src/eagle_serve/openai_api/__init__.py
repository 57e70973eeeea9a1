"""An OpenAI-compatible HTTP API (FastAPI + uvicorn) in front of the Triton server.

protocol.py: request bodies, answers and errors in OpenAI's formats; backend.py: the gRPC
streams to spec_decode; server.py: the routes and the command line
(`python -m eagle_serve.openai_api`).
"""
