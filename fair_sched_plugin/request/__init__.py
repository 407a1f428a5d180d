"""One HTTP request at the boundary: who is calling, its body, its watch (is the client still
there, which lease it holds), its usage, and the responses it is told."""
