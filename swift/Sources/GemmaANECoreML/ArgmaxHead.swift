import GemmaANE

/// The published layout's last chunk (CoreML-LLM's builds) ends in an in-graph argmax: it returns the chosen
/// `token_id`, not logits. Such a bundle runs greedy only: sampling, and logit bias, need the logits it never
/// returns, so a request for them is refused in one line rather than silently decoded greedily (as the Python
/// runtime refuses it: gemma_ane/runtime/model.py).
public enum ArgmaxHead {
    /// Whether `last` (a bundle's last chunk) returns `token_id` instead of `logits`.
    public static func returnsTokenID(_ last: any ChunkRunner) -> Bool {
        let outputs = last.interfaces["infer"]?.outputs.map(\.name) ?? []
        return !outputs.contains("logits") && outputs.contains("token_id")
    }

    /// Throws unless the request is greedy (temperature 0 or top-k 1) without logit bias, for an argmax head.
    public static func check(last: any ChunkRunner, temperature: Double, topK: Int, hasLogitBias: Bool) throws {
        guard returnsTokenID(last), temperature != 0 && topK != 1 || hasLogitBias else { return }
        throw GemmaANEError(
            .input,
            "\(last.name) returns only the argmax token (published layout): sampling and logit bias are not possible; "
                + "use temperature 0 (\(hasLogitBias ? "logit bias" : "temperature \(temperature)") asked)")
    }
}
