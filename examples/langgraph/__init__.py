"""A LangGraph ReAct agent through ``langchain-openai``'s ``ChatOpenAI`` pointed at the proxy."""
