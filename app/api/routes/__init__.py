"""One thin router per resource: parse the request, call one service, return its model."""
