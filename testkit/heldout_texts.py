"""Held-out prose for quantization quality: written for this project, published nowhere else.

A famous passage (the Dickens opening in tests/engine/test_quantization.py) is partly memorized by
the demo model, and memorization is the first thing 4-bit rounding loses: int4 GPTQ group 128 gives
1.53x perplexity there against 1.11x on these texts. These measure ordinary text the model has never
seen, in several registers, ~1,070 tokens in all; none is in engine/weights/calibration.py.
"""

from __future__ import annotations

HELDOUT_TEXTS = (
    "The harbour town of Kellmouth wakes before the sun. By four in the morning the first boats "
    "are already sliding past the breakwater, their engines low and steady, and the gulls have "
    "started arguing over the scraps left on the quay. Marta Oyelaran has run the fish market "
    "there for eleven years. She knows every captain by the sound of his diesel, and she can "
    "tell from the way a crate is stacked whether the night went well. On a good day the market "
    "sells around three tonnes of cod, plaice and mackerel before nine o'clock; on a bad one the "
    "buyers from the city restaurants drive home with half-empty vans and long faces. Lately the "
    "bad days have come more often. The water is warmer than it used to be, the shoals move "
    "north earlier in the year, and fuel costs twice what it did when she started. Still, she "
    "says, nobody in Kellmouth talks about leaving. They talk about the weather, about the price "
    "of ice, and about whose grandson has finally passed his skipper's exam.",
    "A hash table stores key-value pairs in an array of buckets. To insert a pair, the table "
    "computes a hash of the key, reduces it modulo the number of buckets, and places the pair in "
    "the bucket at that index. Two different keys can land in the same bucket, which is called a "
    "collision. One common way to handle collisions is chaining, where each bucket holds a short "
    "list of pairs; another is open addressing, where the table probes nearby slots until it "
    "finds an empty one. As the table fills up, collisions become more frequent and lookups slow "
    "down, so most implementations grow the array, often doubling it, once the ratio of stored "
    "items to buckets passes a threshold such as 0.75. Growing requires rehashing every key, "
    "which is expensive, but because it happens rarely the average cost of an insertion remains "
    "constant. A good hash function spreads keys evenly and is fast to compute; a poor one can "
    "turn a table into a slow linked list.",
    "Dear Mr. Alvarez,\n\nThank you for your letter of 14 March about the noise from the "
    "construction site on Birch Lane. I have spoken with the site manager, and the contractor has "
    "agreed to start work no earlier than eight in the morning on weekdays and not at all on "
    "Sundays. They will also move the generator to the far side of the lot, away from the houses. "
    "If the noise continues outside these hours, please call the council's environmental health "
    "team on the number below and give them the date and time; they can send an officer to take "
    "measurements. I am sorry for the disruption you and your neighbours have had over the past "
    "few weeks, and I hope these changes make a real difference.\n\nYours sincerely,\nHelen "
    "Marsh\nCouncillor, Westfield Ward",
    "To repot a houseplant, choose a container only a few centimetres wider than the old one; a "
    "pot that is much larger holds too much wet soil around the roots and can cause them to rot. "
    "Water the plant a day before, so the root ball slides out more easily. Turn the pot on its "
    "side, support the base of the stems with one hand, and ease the plant out. If the roots "
    "circle tightly around the outside, tease them apart gently with your fingers. Put a layer "
    "of fresh potting mix in the new pot, set the plant at the same depth as before, and fill "
    "the gaps around it, pressing lightly to remove large air pockets. Water thoroughly until it "
    "drains from the bottom, then keep the plant out of direct sun for a week while it settles. "
    "Most plants need repotting every one to two years, ideally in spring when they start to grow.",
    "When the committee met again in October, the mood had changed. The spring survey had shown "
    "that fewer than a third of residents used the old library building more than once a year, "
    "and several members argued that the money set aside for its repair would do more good if it "
    "were spent on the mobile library van and on longer opening hours at the branch near the "
    "station. Others pointed out that the survey had been sent only by email, so it had missed "
    "many older people, who were exactly the ones most likely to rely on the building. After "
    "two hours of discussion the chair proposed a compromise: the roof would be repaired, since "
    "leaving it would only raise the cost later, but any larger renovation would wait until a "
    "second survey, this time on paper and in person, had been carried out over the winter.",
    "Priya had never been good at waiting. She checked the departures board for the fourth time "
    "in ten minutes and watched the word DELAYED blink beside her train. Around her, the station "
    "had filled with people in damp coats, holding paper cups of coffee and staring at their "
    "phones. A small boy in a yellow raincoat was walking along the edge of the tiled floor as if "
    "it were a tightrope, arms stretched out, while his father pretended not to watch. When the "
    "announcement finally came, it was not the one anyone wanted: a signal failure outside the "
    "city meant that all services would be at least an hour late. Priya sighed, found a bench "
    "near the window, and took out the book she had been carrying around for weeks without "
    "opening. It turned out, to her surprise, to be exactly what she needed.",
)
