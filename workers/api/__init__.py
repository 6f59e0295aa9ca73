"""forkq's HTTP API (`forkq serve`): REST under `/v1`, Server-Sent Events, bearer tokens; docs/api.md.

Nothing here is imported by `workers.client` or at the start of `forkq`: FastAPI and uvicorn load
only when `forkq serve` runs (`workers.api.server`), or when a caller builds the app (`workers.api.app`).
"""
