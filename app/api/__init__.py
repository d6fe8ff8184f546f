"""The REST API: dependencies (`deps`), errors, middleware, metrics and thin routers (`routes/`).
`app.main.create_app` assembles them; `app.lifespan` builds what they use."""
