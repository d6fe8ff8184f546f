"""Request services: one request each, owning its transaction (`credits`, `rewrite`, `policies`,
`keys`, `health`, `audit`). The API routes and the CLI call them."""
