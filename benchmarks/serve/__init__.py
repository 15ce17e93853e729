"""The HTTP serving benchmark's two processes: the ASGI app uvicorn serves, and the load generator that drives it."""
