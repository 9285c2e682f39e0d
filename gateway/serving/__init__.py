"""The serving shell of one gateway process: uvicorn serving (`server`: its config, the threaded and
quiet servers, several servers in one loop), the HTTP protocol subclass that bounds request heads and
stalled sends (`request_head`), graceful shutdown on SIGTERM (`lifecycle`) and re-reading the config
into the running process (`reload`, SIGHUP and `POST /admin/reload`). The app and its endpoints build
on it (gateway/app.py, gateway/api/); the processes that run it are gateway/process/. This file imports
nothing."""
