"""The harnesses behind `fp8route bench e2e` and `fp8route bench serve`: loads, drivers, reports.

They run the library as a user does (load_model, LLM, the HTTP server) and measure it; nothing in the
runtime imports them.
"""
