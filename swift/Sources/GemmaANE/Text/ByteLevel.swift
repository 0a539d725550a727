/// GPT-2's byte-level alphabet and pre-tokenizer regex, as the `tokenizers` library's ByteLevel has them.
enum ByteLevel {
    /// `bytes_to_unicode`: printable bytes stand for themselves, the others shifted past U+0100.
    static let symbols: [Unicode.Scalar] = {
        var out = [Unicode.Scalar]()
        var shift: UInt32 = 0
        for byte in UInt32(0)..<256 {
            let printable = (33...126).contains(byte) || (161...172).contains(byte) || (174...255).contains(byte)
            if printable {
                out.append(Unicode.Scalar(byte)!)
            } else {
                out.append(Unicode.Scalar(256 + shift)!)
                shift += 1
            }
        }
        return out
    }()

    static let bytes: [UInt32: UInt8] = Dictionary(uniqueKeysWithValues: symbols.enumerated().map { ($1.value, UInt8($0)) })

    /// A word's UTF-8 bytes as alphabet characters.
    static func encode(_ word: String) -> String {
        var scalars = String.UnicodeScalarView()
        for byte in word.utf8 { scalars.append(symbols[Int(byte)]) }
        return String(scalars)
    }

    /// The bytes a piece stands for, or nil when a character of it is outside the alphabet.
    static func decode(_ piece: String) -> [UInt8]? {
        var out = [UInt8]()
        for scalar in piece.unicodeScalars {
            guard let byte = bytes[scalar.value] else { return nil }
            out.append(byte)
        }
        return out
    }

    /// GPT-2's pattern, `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`, by hand:
    /// the first alternative that matches at each place, as a backtracking regex takes them.
    static func split(_ text: String) -> [String] {
        let s = Array(text.unicodeScalars)
        var out = [String]()
        var i = 0
        func run(from: Int, _ test: (Unicode.Scalar) -> Bool) -> Int {
            var j = from
            while j < s.count, test(s[j]) { j += 1 }
            return j
        }
        while i < s.count {
            var end = i
            if s[i] == "'", i + 1 < s.count {
                for suffix in ["s", "t", "re", "ve", "m", "ll", "d"] {
                    let u = Array(suffix.unicodeScalars)
                    if i + 1 + u.count <= s.count, Array(s[(i + 1)..<(i + 1 + u.count)]) == u {
                        end = i + 1 + u.count
                        break
                    }
                }
            }
            if end == i {
                let body = s[i] == " " && i + 1 < s.count ? i + 1 : i
                for test in [isLetter, isNumber, { !isSpace($0) && !isLetter($0) && !isNumber($0) }] {
                    if body < s.count, test(s[body]) {
                        end = run(from: body, test)
                        break
                    }
                }
            }
            if end == i {
                // whitespace: all of it before the end or before more whitespace; one short of a non-space
                let stop = run(from: i, isSpace)
                end = stop < s.count && stop - i > 1 ? stop - 1 : stop
            }
            var piece = String.UnicodeScalarView()
            piece.append(contentsOf: s[i..<end])
            out.append(String(piece))
            i = end
        }
        return out
    }

    static func isLetter(_ c: Unicode.Scalar) -> Bool {
        switch c.properties.generalCategory {
        case .uppercaseLetter, .lowercaseLetter, .titlecaseLetter, .modifierLetter, .otherLetter: return true
        default: return false
        }
    }

    static func isNumber(_ c: Unicode.Scalar) -> Bool {
        switch c.properties.generalCategory {
        case .decimalNumber, .letterNumber, .otherNumber: return true
        default: return false
        }
    }

    static func isSpace(_ c: Unicode.Scalar) -> Bool { c.properties.isWhitespace }
}
