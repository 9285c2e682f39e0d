"""`python -m gateway.llamacpp_worker --port N --ctx 2048`: serve SmolLM2 with llama.cpp until SIGTERM/SIGINT."""

from gateway.llamacpp_worker.serve import main

raise SystemExit(main())
