"""The OpenAI-compatible server: answers behind cartridges, batching concurrent requests.

- `options`: the typed server config and its command-line options
- `selector`: which prefix rows a request sits behind (cartridge mode: the loaded files composed)
- `fleet_selector`: fleet mode: documents retrieved per conversation, follow-ups behind their kept KV
- `engine`: the background decode loop that owns the model and runs one batch for all requests
- `schema`, `text`, `errors`: request validation, detokenization with stop strings, error bodies
- `app`: the HTTP routes; `main`: model loading, uvicorn and SIGHUP
"""
