"""The HTTP pieces that tierkv's processes share (a server, its HTTP front, the controller):
request helpers (:mod:`.requests`), the dashboard and the health routes (:mod:`.pages`),
``POST /lookup`` (:mod:`.lookup`) and uvicorn on a pre-bound socket (:mod:`.serving`).
Below the server and the controller: it imports neither."""
