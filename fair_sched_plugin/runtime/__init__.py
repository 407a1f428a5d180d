"""The asyncio side around the sans-I/O core: the service every integration calls, the driver
that owns the futures and timers, charging, keep-alive, drain and shutdown."""
