from eagle_serve.openai_api.server import main

main()
