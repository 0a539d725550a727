/// Substring work on UTF-8 bytes, as Python and the `tokenizers` library do it on code points. Swift's String
/// (and Foundation's) compare by grapheme and canonical equivalence: a space followed by a combining mark is one
/// Character, so neither `hasPrefix(" ")` nor a search for " " finds that space, where the tokenizer does.
enum ByteText {
    /// Every occurrence of `pattern` (non-empty) in `text` replaced by `replacement`, left to right.
    static func replacing(_ text: String, _ pattern: String, with replacement: String) -> String {
        let parts = split(text, on: pattern)
        return parts.count == 1 ? text : parts.joined(separator: replacement)
    }

    /// `text` cut at each occurrence of `pattern` (non-empty), the occurrences dropped.
    static func split(_ text: String, on pattern: String) -> [String] {
        let t = Array(text.utf8), p = Array(pattern.utf8)
        guard !p.isEmpty, t.count >= p.count else { return [text] }
        var out = [String]()
        var start = 0, i = 0
        while i + p.count <= t.count {
            if t[i] == p[0] && t[i..<(i + p.count)].elementsEqual(p) {
                out.append(String(decoding: t[start..<i], as: UTF8.self))
                i += p.count
                start = i
            } else {
                i += 1
            }
        }
        out.append(String(decoding: t[start...], as: UTF8.self))
        return out
    }

    static func hasPrefix(_ text: String, _ prefix: String) -> Bool { text.utf8.starts(with: prefix.utf8) }
}
