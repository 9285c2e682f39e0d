"""`python -m gateway.cpu_engine --port N --ctx 2048`: serve SmolLM2 with llama.cpp until SIGTERM/SIGINT."""

from gateway.cpu_engine.serve import main

raise SystemExit(main())
