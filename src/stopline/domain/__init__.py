"""The contract as pure values: vocabulary, transition tables, records, receipts."""
